"""Use case: does a newly tuned winner (the challenger) take the registered champion's alias?

One rule for every face: `pdserve tune --register`, the pipeline's tune step and the re-tuning CronWorkflow all
pass a :class:`ChampionPolicy` and call :func:`check_against_champion` before logging to MLflow; the pure
comparison is :func:`runtime.tuner.champion.compare_with_champion`. The registry is read through the callable
the face passes in, so the rule itself does no I/O and never prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

from runtime.config import DeploymentSpec
from runtime.tuner.champion import (
    DEFAULT_MIN_IMPROVEMENT_PCT, ChampionComparison, champion_perf, compare_with_champion, evaluate_deployment,
)
from runtime.tuner.search import TuneResult
from runtime.tuner.workload import LengthSample

# reads the champion of a registered model: (version, DeploymentSpec), or None when it has none yet
ChampionReader = Callable[[str], "tuple[str, DeploymentSpec] | None"]


class ChampionPolicy(BaseModel):
    """When a new winner replaces the champion (alias ``champion`` of the registered model)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_improvement_pct: float = Field(
        DEFAULT_MIN_IMPROVEMENT_PCT, ge=0,
        description="The winner takes the alias when its deployment costs at least this many percent less than "
                    "the champion's on the same workload, SLO and GPU budget (GPUs on the same GPU type, else "
                    "$/Mtok), or when the champion cannot serve that workload. A first version always takes it.")

    replace_model: bool = Field(
        False, description="Let the winner be registered (and take the alias by the rule) when the champion serves "
                           "another model; false: such a registration is refused (ServedModelChangeError), since "
                           "the next promote would change the model served behind the same InferenceService.")

    @field_validator("min_improvement_pct")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite percentage >= 0")
        return v


class ServedModelChangeError(ValueError):
    """The champion of the registered model serves another model than the winner, and the policy does not allow
    replacing it (ChampionPolicy.replace_model): nothing may be registered. ``message(flag)`` names the face's
    spelling of that permission; ``str()`` names the request field, ``replace_model``."""

    def __init__(self, registered_model: str, version: str, served: str, tuned: str) -> None:
        self.registered_model, self.version, self.served, self.tuned = registered_model, version, served, tuned
        super().__init__(self.message("replace_model"))

    def message(self, flag: str) -> str:
        return (f"registered model {self.registered_model!r}: its champion (version {self.version}) serves "
                f"{self.served!r}, this tuning {self.tuned!r}; registering it would change the model served behind "
                f"the same InferenceService at the next promote, so nothing was registered: register under another "
                f"name, or pass {flag} to replace the served model")


def check_served_model(registered_model: str, champion: "tuple[str, DeploymentSpec] | None", served: str,
                       policy: ChampionPolicy) -> str | None:
    """The rule for a winner that serves another model than the champion: None when the champion (version,
    spec; None: no champion yet) serves ``served``; a note for people when it does not and ``policy``
    allows replacing it.

    Raises:
        ServedModelChangeError: it serves another model and ``policy.replace_model`` is false.
    """
    if champion is None or champion[1].model.name == served:
        return None
    version, cs = champion
    if not policy.replace_model:
        raise ServedModelChangeError(registered_model, str(version), cs.model.name, served)
    return (f"the champion of {registered_model} (version {version}) serves {cs.model.name!r}, this tuning "
            f"{served!r} (replacing the served model was asked for): its deployment is predicted for {served!r}")


@dataclass(frozen=True)
class ChampionCheck:
    """What :func:`check_against_champion` found.

    ``compared_version`` is the champion's version (None: no champion yet, the winner takes the alias);
    ``comparison`` the outcome of the comparison (None without a champion; ``comparison.replace`` says whether
    the winner takes the alias); ``champion_gpu`` the catalog GPU the champion runs on; ``notes`` sentences for
    people (e.g. the champion serves another model).
    """

    compared_version: str | None
    comparison: ChampionComparison | None
    champion_gpu: str = ""
    notes: tuple[str, ...] = ()

    @property
    def replaces(self) -> bool:
        """Whether the winner takes the alias by the rule."""
        return self.comparison is None or self.comparison.replace


def check_against_champion(result: TuneResult, spec: DeploymentSpec, registered_model: str, policy: ChampionPolicy,
                           read_champion: ChampionReader, sample: LengthSample | None = None,
                           champion: "tuple[str, DeploymentSpec] | None" = None, *,
                           prices: "Mapping[str, float] | None" = None) -> ChampionCheck:
    """Compare ``result``'s winner with the champion of ``registered_model``, both predicted on ``result``'s
    model, workload (``sample`` when it was sized for a trace), SLO and ``spec``'s GPU budget.

    ``champion`` (version, spec) is used when the caller already read it (``tune --like`` of the same name);
    else ``read_champion(registered_model)`` is called. ``prices`` ({GPU name: USD per GPU-hour},
    runtime.perf.instances.parse_price_overrides) must be the mapping the tuning priced ``result`` with, so
    both sides' $/Mtok use the same prices.

    Raises:
        ServedModelChangeError: the champion serves another model than ``spec`` and ``policy`` does not allow
            replacing it (:func:`check_served_model`).
        ValueError: the champion's spec names a GPU the catalog does not know (the message names the version).
        Whatever ``read_champion`` raises when the registry cannot be read (then nothing should be registered:
        a champion is never replaced blindly).
    """
    found = champion if champion is not None else read_champion(registered_model)
    if found is None:
        return ChampionCheck(None, None)
    version, cs = found
    note = check_served_model(registered_model, found, spec.model.name, policy)
    notes = [] if note is None else [note]
    try:
        perf = champion_perf(result.model, cs, result.perf)
    except KeyError as e:  # a GPU the catalog no longer knows
        raise ValueError(f"champion version {version}: {e.args[0] if e.args else e}") from None
    old = evaluate_deployment(perf, cs, result.slo, result.workload, spec.planner.gpu_budget, sample, prices)
    cmp = compare_with_champion(result.best, old, same_gpu=perf.gpu.name == result.gpu.name,
                                min_improvement_pct=policy.min_improvement_pct)
    return ChampionCheck(str(version), cmp, perf.gpu.name, tuple(notes))
