"""Offline validation of Argo objects (runtime/batch/workflows.py builds them): the vendored Argo Workflow CRD
schema (runtime/deploy/schemas/argoproj.io_v1alpha1_workflow.json, strict about unknown fields), a CronWorkflow's
``spec.workflowSpec`` as a Workflow ``spec`` plus the cron-only fields by hand (no CronWorkflow CRD is vendored),
and what the schema leaves to the controller (entrypoint, container image, mounts naming volumes)."""

from __future__ import annotations

import copy
import re
from typing import Any, Iterable

from runtime.batch.workflow_specs import (API_VERSION, CRON_NAME_MAX, DNS_LABEL, WORKFLOW_NAME_MAX, check_cron,
                                          check_timezone)

# ---------------------------------------------------------------------------------------------------- validation

_CRON_SPEC_KEYS = {"schedules", "timezone", "concurrencyPolicy", "startingDeadlineSeconds", "suspend",
                   "successfulJobsHistoryLimit", "failedJobsHistoryLimit", "workflowSpec", "workflowMetadata",
                   "stopStrategy", "when"}


def _controller_problems(ident: str, path: str, spec: Any) -> list[str]:
    """What the CRD schema leaves to the controller: entrypoint names a template, containers have an image,
    volume mounts name a volume of the template or the workflow, containers do not refer to steps' outputs
    (out of their scope), and steps templates refer to what exists (``_steps_problems``)."""
    if not isinstance(spec, dict):
        return []
    out: list[str] = []
    templates = [t for t in spec.get("templates") or [] if isinstance(t, dict)]
    names = {t.get("name") for t in templates}
    if spec.get("entrypoint") not in names:
        out.append(f"{ident}: {path}.entrypoint: {spec.get('entrypoint')!r} names no template")
    wf_volumes = {v.get("name") for v in spec.get("volumes") or [] if isinstance(v, dict)}
    for i, t in enumerate(templates):
        c = t.get("container")
        if not isinstance(c, dict):
            continue
        tpath = f"{path}.templates[{i}]"
        if not c.get("image"):
            out.append(f"{ident}: {tpath}.container.image: a container needs an image")
        if re.search(r"\{\{\s*(steps|tasks)\.", str(c)):
            out.append(f"{ident}: {tpath}.container: refers to steps./tasks. outputs, which a container template "
                       "cannot see (pass them in as input parameters)")
        volumes = wf_volumes | {v.get("name") for v in t.get("volumes") or [] if isinstance(v, dict)}
        for j, vm in enumerate(c.get("volumeMounts") or []):
            if isinstance(vm, dict) and vm.get("name") not in volumes:
                out.append(f"{ident}: {tpath}.container.volumeMounts[{j}].name: {vm.get('name')!r} names no volume")
    out += _steps_problems(ident, path, templates)
    return out


_STEP_OUTPUT = re.compile(r"\{\{\s*steps\.([-\w]+)\.outputs\.parameters\.([-\w]+)\s*\}\}")


def _steps_problems(ident: str, path: str, templates: list[dict[str, Any]]) -> list[str]:
    """Steps templates: every step names a template; every ``{{steps.S.outputs.parameters.P}}`` (``when``,
    arguments) names an EARLIER step S whose template declares output parameter P; every input parameter without
    a default of the called template gets an argument (what the controller refuses at submission)."""
    by_name = {t.get("name"): t for t in templates}
    out: list[str] = []
    for i, t in enumerate(templates):
        if not isinstance(t.get("steps"), list):
            continue
        seen: dict[str, dict[str, Any]] = {}
        for g, group in enumerate(t["steps"]):
            current: dict[str, dict[str, Any]] = {}
            for j, step in enumerate(group if isinstance(group, list) else []):
                if not isinstance(step, dict):
                    continue
                where = f"{path}.templates[{i}].steps[{g}][{j}]"
                called = by_name.get(step.get("template"))
                if called is None:
                    out.append(f"{ident}: {where}.template: {step.get('template')!r} names no template")
                    continue
                for s_name, p_name in _STEP_OUTPUT.findall(str({k: v for k, v in step.items() if k != "name"})):
                    declared = {p.get("name") for p in ((seen.get(s_name) or {}).get("outputs") or {}).get(
                        "parameters") or []}
                    if s_name not in seen or p_name not in declared:
                        out.append(f"{ident}: {where}: steps.{s_name}.outputs.parameters.{p_name} is not an output "
                                   "parameter of an earlier step")
                given = {p.get("name") for p in (step.get("arguments") or {}).get("parameters") or []}
                for p in (called.get("inputs") or {}).get("parameters") or []:
                    if "value" not in p and "default" not in p and p.get("name") not in given:
                        out.append(f"{ident}: {where}.arguments: input parameter {p.get('name')!r} of template "
                                   f"{called.get('name')!r} is not given")
                current[step.get("name")] = called
            seen.update(current)
    return out


def _cron_problems(ident: str, spec: dict[str, Any]) -> list[str]:
    out = [f"{ident}: spec.{k}: unknown CronWorkflow field"
           for k in sorted(set(spec) - _CRON_SPEC_KEYS - {"schedule"})]
    if "schedule" in spec:
        out.append(f"{ident}: spec.schedule: removed in Argo Workflows v4, use schedules (a list)")
    schedules = spec.get("schedules")
    if not isinstance(schedules, list) or not schedules:
        out.append(f"{ident}: spec.schedules: must be a non-empty list of cron expressions")
    else:
        for i, s in enumerate(schedules):
            try:
                check_cron(s)
            except ValueError as e:
                out.append(f"{ident}: spec.schedules[{i}]: {e}")
    if spec.get("concurrencyPolicy", "Allow") not in ("Allow", "Forbid", "Replace"):
        out.append(f"{ident}: spec.concurrencyPolicy: {spec['concurrencyPolicy']!r} is not Allow, Forbid or Replace")
    for k in ("startingDeadlineSeconds", "successfulJobsHistoryLimit", "failedJobsHistoryLimit"):
        v = spec.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            out.append(f"{ident}: spec.{k}: {v!r} is not a non-negative integer")
    if "timezone" in spec:
        try:
            check_timezone(spec["timezone"] if isinstance(spec["timezone"], str) else "")
        except ValueError as e:
            out.append(f"{ident}: spec.timezone: {e}")
    if "suspend" in spec and not isinstance(spec["suspend"], bool):
        out.append(f"{ident}: spec.suspend: must be a boolean")
    if not isinstance(spec.get("workflowSpec"), dict):
        out.append(f"{ident}: spec.workflowSpec: required (a Workflow spec)")
    return out


def validate_workflow_objects(objs: Iterable[dict[str, Any]]) -> list[str]:
    """Problems with Argo ``Workflow`` / ``CronWorkflow`` objects; empty when all are valid.

    A Workflow is checked against the vendored Argo Workflow CRD schema (``runtime.deploy.validate``; one with
    only ``generateName`` as if the controller had appended 5 characters); a CronWorkflow's ``spec.workflowSpec``
    the same way as a Workflow ``spec``, its own fields (``schedules``: 5-field crons, ``concurrencyPolicy``:
    Allow/Forbid/Replace, non-negative deadlines and history limits, IANA ``timezone``, no unknown field) by hand.
    Both also get the controller's checks (entrypoint names a template, containers have an image, mounts name a
    volume, a step's ``{{steps.S.outputs.parameters.P}}`` names an output parameter of an earlier step, a called
    template's input parameters are given, no container refers to steps' outputs). Never raises for a bad object: every problem is a "Kind/name: field.path: reason" string.
    """
    from runtime.deploy.errors import ManifestError
    from runtime.deploy.validate import validate_object

    problems: list[str] = []
    for obj in objs:
        if not isinstance(obj, dict):
            problems.append(f"object is a {type(obj).__name__}, not a mapping")
            continue
        kind = obj.get("kind")
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        name = meta.get("name") or meta.get("generateName")
        ident = f"{kind}/{name}"
        if obj.get("apiVersion") != API_VERSION or kind not in ("Workflow", "CronWorkflow"):
            problems.append(f"{ident}: apiVersion/kind: not an {API_VERSION} Workflow or CronWorkflow")
            continue
        if not isinstance(name, str) or not name:
            problems.append(f"{ident}: metadata.name: a name or generateName is required")
            continue
        spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
        if kind == "Workflow":
            candidate = copy.deepcopy(obj)
            if not meta.get("name"):
                candidate["metadata"]["name"] = f"{name}abcde"
                if len(candidate["metadata"]["name"]) > 63:
                    problems.append(f"{ident}: metadata.generateName: longer than {WORKFLOW_NAME_MAX} characters")
            prefix, path = "", "spec"
        else:
            if len(name) > CRON_NAME_MAX or not DNS_LABEL.match(name):
                problems.append(f"{ident}: metadata.name: must be a DNS-1123 label of at most {CRON_NAME_MAX} "
                                "characters")
            problems += _cron_problems(ident, spec)
            if not isinstance(spec.get("workflowSpec"), dict):
                continue
            candidate = {"apiVersion": API_VERSION, "kind": "Workflow",
                         "metadata": {k: v for k, v in meta.items() if k in ("name", "namespace", "labels")},
                         "spec": spec["workflowSpec"]}
            prefix, path = "spec.workflowSpec", "spec.workflowSpec"
        try:
            validate_object(candidate)
        except ManifestError as e:
            msg = str(e)
            head = f"Workflow/{candidate['metadata'].get('name')}: "
            rest = msg[len(head):] if msg.startswith(head) else msg
            if prefix and rest.startswith("spec."):
                rest = prefix + rest[len("spec"):]
            elif prefix and rest.startswith("spec:"):
                rest = prefix + rest[len("spec"):]
            problems.append(f"{ident}: {rest}")
        problems += _controller_problems(ident, path, candidate.get("spec"))
    return problems
