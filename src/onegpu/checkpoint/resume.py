"""Which checkpoint --output.resume means (latest in a run directory, a checkpoint folder, a run
directory) and whether it may be resumed by this run: complete by its manifest, written with the
same training.objective."""

from __future__ import annotations

from pathlib import Path

from onegpu.checkpoint.local import clean_stale, find_latest, step_of
from onegpu.checkpoint.manifest import MANIFEST, verify
from onegpu.errors import ConfigError


def resolve_resume(resume: str | None, run_dir: Path, objective: str | None = None) -> Path | None:
    """--output.resume: "latest" (in the run directory), a checkpoint folder or a run directory.
    With ``objective`` (training.objective), a checkpoint trained with another one is refused here,
    before anything is built for the new objective (a DPO reference, preference data)."""
    found = _resolve_resume(resume, run_dir)
    if found is not None and objective is not None:
        check_objective(found, objective)
    return found


def check_objective(path: Path, objective: str) -> None:
    """The checkpoint's training.objective (its config.yaml; sft where none is recorded) must be
    this run's: an SFT checkpoint has no reference log-probs or preference state to resume DPO
    from."""
    config = _saved_config(path)
    if config is None:
        return  # written without a config (a checkpoint built by hand): nothing to compare
    was = (config.get("training") or {}).get("objective") or "sft"
    if was != objective:
        weights = Path(path) / "model"
        raise ConfigError(
            f"checkpoint {path} was trained with training.objective={was}; this run asks for "
            f"{objective}.",
            hint=f"resume with --training.objective {was}, or start a new {objective} run from its "
            f"weights: --model.name {weights} without --output.resume",
        )


def _saved_config(path: Path) -> dict | None:
    """The run configuration a checkpoint recorded (its own config.yaml, else its run's)."""
    import yaml

    for candidate in (Path(path) / "config.yaml", Path(path).parent / "config.yaml"):
        if candidate.is_file():
            try:
                data = yaml.safe_load(candidate.read_text(encoding="utf-8"))
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(data, dict):
                return data
    return None


def _resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    if not resume:
        return None
    target = Path(run_dir) if resume == "latest" else Path(resume).expanduser()
    if not target.is_dir():
        raise ConfigError(
            f"output.resume: '{target}' does not exist.",
            hint="pass 'latest' with the run's --output.name, or a checkpoint folder",
        )
    if resume == "latest" or not (target / MANIFEST).exists():
        clean_stale(target)
    if step_of(target) >= 0 and (target / MANIFEST).exists():
        problem = verify(target)
        if problem:
            raise ConfigError(
                f"output.resume: checkpoint {target} is damaged ({problem}).",
                hint="resume from an older checkpoint, or use 'latest' to pick the newest good one",
            )
        return target
    found = find_latest(target)
    if found is None:
        raise ConfigError(
            f"output.resume: no complete checkpoint in {target}.",
            hint="check --output.dir/--output.name, or start without --output.resume",
        )
    return found
