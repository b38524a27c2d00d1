"""The command line's overrides before composition: Hydra's own ``hydra.*`` settings, which sysx
does not read (refused, naming what sysx uses instead), and sweeps (``a,b``, ``range(...)``,
``choice(...)``), expanded into one override list per point for ``sysx-train -m``.

sysx composes ``conf/`` with Hydra's compose API and runs the job itself, so no Hydra run
directory, working-directory change, logging setup or launcher plugin is involved.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from sysx.config.checks import ConfigError

# hydra.<key> -> what sysx reads instead; the first key that the override's key starts with wins
HYDRA_INSTEAD = {
    "hydra.run.dir": "run_dir=<dir>",
    "hydra.sweep.dir": "run_dir=<dir> (a sweep, -m, writes point n into <run_dir>/<n>)",
    "hydra.sweep.subdir": "run_dir=<dir> (a sweep, -m, writes point n into <run_dir>/<n>)",
    "hydra.job.chdir": "nothing to set: sysx never changes the working directory (paths are relative to where it starts)",
    "hydra.verbose": "log.every=1 (a line every step; metrics.jsonl has every step)",
    "hydra.mode": "-m (--multirun) for a sweep",
    "hydra.job.name": "run_dir=<dir>",
    "hydra.output_subdir": "run_dir=<dir> (it gets config.yaml)",
}


def refuse_hydra_keys(overrides: Sequence[str]) -> None:
    """A :class:`ConfigError` for the first ``hydra.*`` or ``hydra/<group>=`` override (Hydra would drop it silently)."""
    for text in overrides:
        key = text.split("=", 1)[0].lstrip("+~")
        if key != "hydra" and not key.startswith(("hydra.", "hydra/")):
            continue
        use = next((v for k, v in HYDRA_INSTEAD.items() if key == k or key.startswith(k + ".")), None)
        raise ConfigError(
            f"{text}: sysx-train does not read Hydra's own settings (hydra.*); instead: "
            f"{use or 'run_dir=<dir> for the output folder and -m (--multirun) for a sweep'}"
        )


def sweep_points(overrides: Sequence[str]) -> list[list[str]]:
    """The overrides of every point of the sweep they describe, in Hydra's order (the last swept key
    varies fastest); one point when nothing is swept. Overrides Hydra cannot parse come back as
    they are, for composition to explain."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return [list(overrides)]
    choices: list[list[str]] = []
    for override in parsed:
        if not override.is_sweep_override():
            choices.append([str(override.input_line)])
            continue
        key = override.get_key_element()
        try:
            values = list(override.sweep_string_iterator())
        except HydraException:
            raise ConfigError(
                f"{override.input_line}: this sweep cannot be listed; sweep over values a,b or range(start,stop[,step])"
            ) from None
        choices.append([f"{key}={value}" for value in values])
    return [list(point) for point in itertools.product(*choices)]
