"""frforensics: flight-recorder forensics for PyTorch distributed training.

The recorder (``frforensics.recorder``, needs torch) records every collective and
p2p op of every process group inside a training job and dumps from every rank when
one hangs. The analyzer (``frforensics.analyzer``, no torch) reads those dumps and
PyTorch's own flight-recorder dumps and names the rank that caused the hang.
"""

__version__ = "0.1.0"
