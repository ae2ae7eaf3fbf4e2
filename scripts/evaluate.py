"""Evaluate a checkpoint on a KITTI-format root:
the same command as ``detector-evaluate`` (:mod:`detector.commands.evaluate`), Hydra overrides as
arguments (see the README)."""

from detector.commands.evaluate import main

if __name__ == "__main__":
    main()
