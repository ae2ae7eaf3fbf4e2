"""Train the BEV detector: the same command as ``detector-train`` (:mod:`detector.commands.train`), Hydra overrides as
arguments (see the README)."""

from detector.commands.train import main

if __name__ == "__main__":
    main()
