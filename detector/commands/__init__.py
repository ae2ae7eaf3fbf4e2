"""The command-line programs: ``detector-<name>`` console entry points and the thin ``scripts/<name>.py``
call the same ``main`` here. ``train`` and ``evaluate`` take Hydra overrides, the others ``key=value``
arguments (:func:`detector.cli.parse_args`)."""

__all__ = [
    "analyze_errors", "convert_dataset", "evaluate", "export", "inspect_dataset", "kitti_eval", "make_dataset",
    "predict", "train", "visualize",
]
