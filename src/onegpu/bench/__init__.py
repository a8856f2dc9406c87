"""Benchmarks: train.py (the sweep), settings.py (its config), arms.py (the guide's methods as arms,
next to HF Trainer and TRL), train_child.py (one arm in a fresh process), train_peers.py (the HF
Trainer and TRL arms), train_report.py (tables and charts), infer.py (generation settings),
infer_report.py (its JSON, Markdown table and chart)."""
