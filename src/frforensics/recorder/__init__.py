"""The recorder: runs inside training jobs (needs torch). Filled in by the recorder work."""
