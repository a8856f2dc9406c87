"""The command line: main.py dispatches `onegpu <command>` to one module per command; args.py builds
flags and YAML from the config dataclasses."""
