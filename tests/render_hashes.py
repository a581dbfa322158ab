"""Hashes of everything the deployment code renders, to check that a restructuring changes none of it.

Not a test (a test pinning hashes would fail on every intended change): a helper run before and after a
change, whose two outputs are compared::

    PYTHONPATH=. python tests/render_hashes.py > before.json
    # ... change the code ...
    PYTHONPATH=. python tests/render_hashes.py --compare before.json

What is hashed (SHA-256 of canonical JSON or of the bytes):

- ``bundle/<profile>``: every built-in node profile's bundle (``infra.node.bundle.render.render_bundle``), per
  file;
- ``stack/<stack>/inputs``: every custom resource a stack's program declares under the mocks of
  ``tests/pulumi_harness.py`` (type, logical name, inputs as the provider gets them), per resource;
- ``stack/<stack>/tree``: the same with component resources and URNs (parents): moving a resource under a
  new component changes this one (and needs an alias), not ``inputs``;
- ``stack/<stack>/outputs``: the stack's outputs; ``stack/<stack>/build``: files the program wrote;
- ``k8s/<stack>/<region>``: the manifests of a region's Kubernetes objects from that stack's run;
- ``k8s/fixture/<profile>``: ``infra.k8s.region.region_objects`` of ``tests/k8s_fixtures.make_workload``
  per GPU profile.

``--compare FILE`` prints which groups and which items differ (exit status 1 when any does).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

STACKS = ("dev", "scale5-gcp", "scale5-onprem", "multi-region")


def _jsonable(value: Any) -> Any:
    """Pulumi assets and archives as their kind and path or text (their repr holds a memory address)."""
    for attr in ("path", "text", "uri", "assets"):
        if hasattr(value, attr):
            return {"kind": type(value).__name__, attr: _jsonable(getattr(value, attr))}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def _digest(value: Any) -> str:
    if isinstance(value, bytes):
        data = value
    else:
        data = json.dumps(value, sort_keys=True, default=_jsonable, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _group(items: dict[str, str]) -> dict[str, Any]:
    return {"hash": _digest(sorted(items.items())), "items": items}


def bundles() -> dict[str, dict[str, Any]]:
    """``{"bundle/<profile>": group}`` for every built-in profile."""
    from infra.node.bundle.render import render_bundle
    from infra.node.profile.profiles import PROFILES

    return {
        f"bundle/{name}": _group({path: _digest(content) for path, content in render_bundle(profile).items()})
        for name, profile in sorted(PROFILES.items())
    }


def stacks() -> dict[str, dict[str, Any]]:
    """The groups of every stack's mocked run (see the module docstring)."""
    from pulumi_harness import plain, run_stack

    from infra.k8s.manifest import to_manifest

    out: dict[str, dict[str, Any]] = {}
    for stack in STACKS:
        with tempfile.TemporaryDirectory() as tmp:
            build = Path(tmp) / "build"
            run = run_stack(stack, build_dir=build)

            def text(value: Any, build: Path = build) -> Any:
                return json.loads(json.dumps(value, default=_jsonable).replace(str(build), "<build>"))

            inputs, tree, regions = {}, {}, {}
            for r in run.resources:
                key = f"{r.type}::{r.name}"
                if r.custom:
                    inputs[key] = _digest(text(plain(r.inputs)))
                tree[key] = _digest([r.urn, r.custom])
                if r.type.startswith("kubernetes:") and r.custom and r.name.startswith("runtime-"):
                    region = r.name.removeprefix("runtime-").split("-")
                    region_name = "-".join(region[:2])
                    regions.setdefault(region_name, {})[key] = _digest(to_manifest(r.type, r.plain))
            out[f"stack/{stack}/inputs"] = _group(inputs)
            out[f"stack/{stack}/tree"] = _group(tree)
            out[f"stack/{stack}/outputs"] = _group(
                {name: _digest(text(plain(value))) for name, value in run.outputs.items()}
            )
            files = {}
            if build.exists():
                for path in sorted(build.rglob("*")):
                    if path.is_file():
                        files[str(path.relative_to(build))] = _digest(path.read_bytes())
            out[f"stack/{stack}/build"] = _group(files)
            for region, items in sorted(regions.items()):
                out[f"k8s/{stack}/{region}"] = _group(items)
    return out


def fixture_manifests() -> dict[str, dict[str, Any]]:
    """``{"k8s/fixture/<profile>": group}``: the fixture region's objects for every GPU profile."""
    from k8s_fixtures import make_workload

    from infra.capacity.gcp import ACCELERATOR_TYPES
    from infra.k8s.region import region_objects
    from infra.node.profile.profiles import PROFILES

    out = {}
    for name, profile in sorted(PROFILES.items()):
        if profile.gpu not in ACCELERATOR_TYPES or profile.model == "tiny":
            continue
        workload = make_workload(profile=profile, accelerator=ACCELERATOR_TYPES[profile.gpu])
        objects = region_objects(workload)
        items = {f"{i:03d}:{o['kind']}/{o['metadata']['name']}": _digest(o) for i, o in enumerate(objects)}
        out[f"k8s/fixture/{name}"] = _group(items)
    return out


def collect() -> dict[str, dict[str, Any]]:
    """Every group, by name."""
    return {**bundles(), **stacks(), **fixture_manifests()}


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Lines naming the groups and items that differ between two outputs of ``collect``."""
    lines = []
    for group in sorted(set(before) | set(after)):
        old, new = before.get(group), after.get(group)
        if old is None or new is None:
            lines.append(f"{group}: only {'after' if old is None else 'before'}")
            continue
        if old["hash"] == new["hash"]:
            continue
        lines.append(f"{group}: {old['hash']} -> {new['hash']}")
        for item in sorted(set(old["items"]) | set(new["items"])):
            a, b = old["items"].get(item), new["items"].get(item)
            if a != b:
                lines.append(f"  {item}: {a} -> {b}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", type=Path, help="an earlier output to compare with")
    parser.add_argument("--out", type=Path, help="also write the hashes here")
    args = parser.parse_args()
    now = collect()
    if args.out:
        args.out.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    if args.compare is None:
        if not args.out:
            print(json.dumps(now, indent=1, sort_keys=True))
        else:
            for group, value in sorted(now.items()):
                print(f"{value['hash']}  {group}")
        return 0
    lines = compare(json.loads(args.compare.read_text()), now)
    print("\n".join(lines) if lines else f"all {len(now)} groups equal")
    return 1 if lines else 0


if __name__ == "__main__":
    raise SystemExit(main())
