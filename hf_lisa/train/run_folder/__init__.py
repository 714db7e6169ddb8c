"""What ``--output_dir`` may be, and who writes it: the folder checks, ``--resume_from_checkpoint latest`` and the
run's settings class (:mod:`.output_dir`), taken under one lock per folder (:mod:`.run_lock`). Nothing here deletes
or overwrites a file hf-lisa did not write."""
