"""Benchmarks: train.py (the guide's methods as arms, next to HF Trainer), train_child.py (one arm in a
fresh process), train_report.py (tables and charts), infer.py (generation settings)."""
