"""Build the GPU kit: cp312 manylinux x86_64 wheels of what the GPU image lacks (``make gpu-kit``).

Reads ``scripts/gpu/kit.txt`` (name==version a line), downloads each as a binary wheel for the GPU
machine's Python (3.12, x86_64) and builds DeepSpeed's wheel from its sdist here with its ops off
(``DS_BUILD_OPS=0``: a pure-Python wheel). Writes the wheels and ``kit.json`` (names, versions,
sizes) into the output folder and prints a size table, with the total that travels to the GPU
machine: tracked project files + the default data + the kit (limit 48 MiB).

    python -m scripts.gpu.build_kit [--out .gpu_kit]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KIT_LIST = ROOT / "scripts" / "gpu" / "kit.txt"
LIMIT_MIB = 48
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
BUILT_HERE = {"deepspeed"}            # sdist only on the registry: built with its ops off


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_kit(path: Path = KIT_LIST) -> dict[str, str]:
    """{normalised name: version} from kit.txt."""
    kit = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            kit[norm(name)] = version.strip()
    return kit


def _pip(*args: str, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(l for l in proc.stderr.splitlines() if not l.startswith("WARNING"))[-1500:]
        sys.exit(f"error: gpu kit: {' '.join(cmd[3:6])} ... failed:\n{tail}")


def wheel_of(out: Path, name: str) -> Path | None:
    stem = re.sub(r"[-.]+", "_", name)
    hits = [p for p in out.glob("*.whl") if norm(p.name.split("-")[0]) == norm(stem)]
    return hits[0] if len(hits) == 1 else None


def build(out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    kit = read_kit()
    for stale in out.glob("*.whl"):                   # one version of each: two stop the install
        if norm(stale.name.split("-")[0]) not in kit or stale.name.split("-")[1] != kit[norm(stale.name.split("-")[0])]:
            stale.unlink()
    for name, version in kit.items():
        if wheel_of(out, name):
            continue
        if name in BUILT_HERE:
            with tempfile.TemporaryDirectory() as tmp:
                _pip("download", "-q", "--no-deps", "--no-binary=:all:", "-d", tmp, f"{name}=={version}")
                sdist = next(Path(tmp).glob("*.tar.gz"))
                env = {**os.environ, "DS_BUILD_OPS": "0"}
                _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(sdist), env=env)
        else:
            plat = [a for p in PLATFORMS for a in ("--platform", p)]
            _pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                 "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", *plat,
                 "-d", str(out), f"{name}=={version}")
        if not wheel_of(out, name):
            sys.exit(f"error: gpu kit: no wheel for {name}=={version} in {out}")
    rows = [{"name": n, "version": v, "wheel": wheel_of(out, n).name, "bytes": wheel_of(out, n).stat().st_size}
            for n, v in kit.items()]
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    code_bytes = sum((ROOT / f).stat().st_size for f in tracked.decode().split("\0") if f and (ROOT / f).is_file())
    data = ROOT / "data" / "default"
    data_bytes = sum(p.stat().st_size for p in data.rglob("*") if p.is_file()) if data.exists() else 0
    info = {"wheels": rows, "kit_bytes": sum(r["bytes"] for r in rows), "code_bytes": code_bytes,
            "data_bytes": data_bytes}
    info["total_bytes"] = info["kit_bytes"] + code_bytes + data_bytes
    (out / "kit.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".gpu_kit")
    args = ap.parse_args(argv)
    info = build(args.out)
    mib = 2 ** 20
    print(f"{'wheel':58s} {'MiB':>6s}")
    for r in info["wheels"]:
        print(f"{r['wheel']:58s} {r['bytes'] / mib:6.2f}")
    print(f"kit {info['kit_bytes'] / mib:.1f} MiB + project files {info['code_bytes'] / mib:.1f} MiB + "
          f"data/default {info['data_bytes'] / mib:.1f} MiB = {info['total_bytes'] / mib:.1f} MiB "
          f"(limit {LIMIT_MIB} MiB) -> {args.out}")
    if info["total_bytes"] > LIMIT_MIB * mib:
        print(f"error: gpu kit: {info['total_bytes'] / mib:.1f} MiB is over the {LIMIT_MIB} MiB limit", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
