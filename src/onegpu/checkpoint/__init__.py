"""Checkpoints: local.py (atomic folders, exact resume), sharded.py (FSDP2 / DeepSpeed engines)."""
