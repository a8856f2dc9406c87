"""Training methods, one module each; ``prepare.py`` applies them to a model in a fixed order."""
