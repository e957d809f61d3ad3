"""Checkpoint state: distributed save/load with torch.distributed.checkpoint, the manifest and
safe reading, and export to one ordinary file."""
