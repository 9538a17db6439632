"""deploy/: the container images build from the repository's files, the Kubernetes manifests render
with kustomize and validate against the schemas of a current Kubernetes, and the pieces agree (the
gateway's selectors pick the engine pods, its flags parse, its Role allows only reading pods, the
Prometheus config and the monitors name what the manifests define)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.core import ParameterSource

from atomesh.cli import launch_command, normalize_argv
from atomesh.config import load_config, parse_selector

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "deploy" / "docker"
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = {
    "pd": KUBE / "base",
    "regular": KUBE / "overlays" / "regular",
    "monitoring": KUBE / "overlays" / "monitoring",
}
pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------- images
def instructions(dockerfile: Path) -> list[tuple[str, list[str]]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")),
    )
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.split()))
    return out


def copy_sources(dockerfile: Path) -> list[str]:
    sources = []
    for word, args in instructions(dockerfile):
        if word in ("COPY", "ADD") and not any(a.startswith("--from") for a in args):
            sources += [a for a in args[:-1] if not a.startswith("--")]
    return sources


def ignored(path: str) -> bool:
    patterns = [
        p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    ]
    return any(path == p or path.startswith(p + "/") for p in patterns)


@pytest.mark.parametrize("name", ["gateway.Dockerfile", "engine.Dockerfile"])
def test_every_copy_source_exists_in_the_build_context(name: str) -> None:
    sources = copy_sources(DOCKER / name)
    assert "pyproject.toml" in sources and "atomesh" in sources
    for src in sources:
        assert (ROOT / src).exists(), f"{name}: COPY {src}: no such file in the repository"
        assert not ignored(src), f"{name}: COPY {src} is excluded by .dockerignore"


@pytest.mark.parametrize("name", ["gateway.Dockerfile", "engine.Dockerfile"])
def test_images_run_as_a_user_with_a_health_check(name: str) -> None:
    steps = instructions(DOCKER / name)
    users = [args[0] for word, args in steps if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert any(word == "HEALTHCHECK" for word, _ in steps)
    assert any(word == "ENTRYPOINT" for word, _ in steps)


def test_gateway_image_has_no_engine_and_engine_image_takes_cuda_as_a_build_arg() -> None:
    assert "engine" not in copy_sources(DOCKER / "gateway.Dockerfile")
    runs = " ".join(" ".join(args) for word, args in instructions(DOCKER / "gateway.Dockerfile") if word == "RUN")
    assert "torch" not in runs.replace('! /opt/atomesh/bin/python -c "import torch"', "")
    engine = instructions(DOCKER / "engine.Dockerfile")
    assert ("ARG", ["DEVICE=cpu"]) in engine
    stages = [args for word, args in engine if word == "FROM"]
    assert ["${CUDA_IMAGE}", "AS", "base-cuda"] in stages and stages[-1] == ["base-${DEVICE}"]


def test_gateway_image_install_works_in_a_plain_venv(tmp_path: Path) -> None:
    """What the gateway image copies installs as a distribution in a fresh venv, and its command runs
    there without torch or the engine. Offline: the distribution is installed --no-deps, and its
    dependencies are read from this environment, after checking they are all the distribution asks for."""
    context = tmp_path / "context"
    context.mkdir()
    for src in copy_sources(DOCKER / "gateway.Dockerfile"):
        (shutil.copytree if (ROOT / src).is_dir() else shutil.copy)(
            ROOT / src,
            context / src,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / src).is_dir() else {}),
        )
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # The image's pip builds the wheel with setuptools from its build requirements; here this
    # environment's setuptools builds it (offline), and the venv installs only that wheel.
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [
            *pip,
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(tmp_path / "dist"),
            str(context),
        ],
        check=True,
        env=clean,
        timeout=90,
        cwd=tmp_path,
    )
    [wheel] = (tmp_path / "dist").glob("atomesh-*.whl")
    subprocess.run(
        [*pip, "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        env=clean,
        timeout=90,
        cwd=tmp_path,
    )
    # The third-party packages the image would download come from this environment, after this venv's own.
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    ours = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "aiohttp").is_dir())
    (site / "zz-deps.pth").write_text(str(ours) + "\n")
    check = (
        "import importlib.metadata as md, sys\n"
        "import atomesh, atomesh.cli, atomesh.app, atomesh.workers.discovery, kubernetes_asyncio\n"
        "assert atomesh.__file__.startswith(sys.prefix), atomesh.__file__\n"
        "assert 'torch' not in sys.modules and 'engine' not in sys.modules\n"
        "print(sorted(md.requires('atomesh')))\n"
    )
    out = subprocess.run([python, "-c", check], capture_output=True, text=True, env=clean, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    requires = ast.literal_eval(out.stdout)
    core = [r for r in requires if "extra ==" not in r]
    assert core and not any(r.startswith("torch") for r in core)
    assert any(r.startswith("kubernetes_asyncio") and 'extra == "kubernetes"' in r for r in requires)
    launched = subprocess.run(
        [env_dir / "bin" / "atomesh", "launch", "--help"],
        capture_output=True,
        text=True,
        env=clean,
        timeout=60,
        cwd=tmp_path,
    )
    assert launched.returncode == 0 and "--service-discovery" in launched.stdout, launched.stderr
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([python, "-c", "import engine"], check=True, capture_output=True, env=clean, cwd=tmp_path)


# ---------------------------------------------------------------------------- manifests
def render(overlay: Path) -> list[dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and "unknown command" in out.stderr:
        pytest.skip("this kubectl has no kustomize")
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_manifests_render_and_validate_offline(overlay: str) -> None:
    import kubernetes_validate as kv

    docs = render(OVERLAYS[overlay])
    from kubernetes_validate.utils import latest_version

    versions = [latest_version(), "1.31.0"]
    checked = 0
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # the Prometheus Operator's kinds have no schema there (checked below)
        for version in versions:
            kv.validate(doc, version, strict=True)
        assert doc["metadata"].get("namespace", "atomesh") == "atomesh" or doc["kind"] == "Namespace"
        checked += 1
    assert checked >= 8


def gateway_args(docs: list[dict[str, Any]]) -> list[str]:
    [gw] = find(docs, "Deployment", "atomesh-gateway")
    [container] = gw["spec"]["template"]["spec"]["containers"]
    return [a.replace("$(POD_NAMESPACE)", "atomesh") for a in container["args"]]


def parsed(args: list[str]) -> Any:
    """The gateway config the Deployment's arguments give, parsed as `atomesh launch` parses them."""
    ctx = launch_command.make_context("launch", normalize_argv(args))
    flags = {
        k: (list(v) if isinstance(v, tuple) else v)
        for k, v in ctx.params.items()
        if ctx.get_parameter_source(k) is ParameterSource.COMMANDLINE
    }
    return load_config(flags)


@pytest.mark.parametrize("overlay", ["pd", "regular"])
def test_the_gateway_selectors_pick_the_engine_pods(overlay: str) -> None:
    docs = render(OVERLAYS[overlay])
    cfg = parsed(gateway_args(docs))
    assert cfg.service_discovery and cfg.service_discovery_namespace == "atomesh"
    engines = [d for d in find(docs, "Deployment") if d["metadata"]["name"] != "atomesh-gateway"]
    selectors = (
        {"prefill": cfg.prefill_selector, "decode": cfg.decode_selector}
        if cfg.pd_disaggregation
        else {"regular": cfg.selector}
    )
    assert len(engines) == len(selectors)
    for engine in engines:
        labels = engine["spec"]["template"]["metadata"]["labels"]
        picked = [role for role, sel in selectors.items() if parse_selector(sel).items() <= labels.items()]
        assert picked == [labels["atomesh.io/role"]], engine["metadata"]["name"]
        [container] = engine["spec"]["template"]["spec"]["containers"]
        assert {p["containerPort"] for p in container["ports"]} >= {cfg.service_discovery_port}
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}.get(labels["atomesh.io/role"])
        assert (kv_role is None) == (not any("kv-transfer-config" in a for a in container["args"]))
        if kv_role:
            assert kv_role in " ".join(container["args"])


def test_gateway_rbac_probes_service_and_disruption_budget() -> None:
    docs = render(OVERLAYS["pd"])
    [role] = find(docs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding")
    [binding] = find(docs, "RoleBinding")
    [account] = find(docs, "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert [(s["kind"], s["name"], s["namespace"]) for s in binding["subjects"]] == [
        ("ServiceAccount", account["metadata"]["name"], account["metadata"]["namespace"])
    ]
    [gw] = find(docs, "Deployment", "atomesh-gateway")
    pod = gw["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == account["metadata"]["name"]
    [container] = pod["spec"]["containers"]
    probes = {k: container[k]["httpGet"]["path"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes == {"startupProbe": "/health", "livenessProbe": "/liveness", "readinessProbe": "/readiness"}
    cfg = parsed(gateway_args(docs))
    assert pod["spec"]["terminationGracePeriodSeconds"] > cfg.shutdown_grace_period_secs
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": cfg.port, "metrics": cfg.prometheus_port}
    [service] = find(docs, "Service", "atomesh-gateway")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    [pdb] = find(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert gw["spec"]["replicas"] > pdb["spec"].get("maxUnavailable", 0)


def test_monitoring_overlay_and_prometheus_config_name_what_the_manifests_define() -> None:
    docs = render(OVERLAYS["monitoring"])
    [service] = find(docs, "Service", "atomesh-gateway")
    [gw] = find(docs, "Deployment", "atomesh-gateway")
    engine_pods = [d["spec"]["template"] for d in find(docs, "Deployment") if d is not gw]
    [monitor] = find(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    [pods] = find(docs, "PodMonitor")
    for pod in engine_pods:
        assert pods["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        names = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
        assert {e["port"] for e in pods["spec"]["podMetricsEndpoints"]} <= names
    [dashboard] = find(docs, "ConfigMap", "atomesh-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["grafana-dashboard.json"]) == json.loads(
        (ROOT / "deploy" / "grafana-dashboard.json").read_text()
    )

    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    keep = {
        name: next(r["regex"] for r in j["relabel_configs"] if r.get("action") == "keep") for name, j in jobs.items()
    }
    assert keep["atomesh"] == f"{service['metadata']['name']};metrics"
    assert keep["atomesh-engines"] == f"{engine_pods[0]['metadata']['labels']['app.kubernetes.io/name']};http"
    namespaces = {n for j in jobs.values() for sd in j["kubernetes_sd_configs"] for n in sd["namespaces"]["names"]}
    assert namespaces == {gw["metadata"]["namespace"]}


def test_prometheus_config_loads_in_promtool(tmp_path: Path) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed")
    out = subprocess.run(
        ["promtool", "check", "config", str(ROOT / "deploy" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "kubernetes_sd_configs not found" in out.stdout + out.stderr:
        pytest.skip("this promtool is built without Kubernetes service discovery")
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_every_container_runs_the_image_tag_the_docs_build(overlay: str) -> None:
    from atomesh import __version__

    built = set(re.findall(r"-t (atomesh-\w+:[\w.]+) \.", (ROOT / "docs" / "deployment.md").read_text()))
    images = {
        c["image"]
        for d in find(render(OVERLAYS[overlay]), "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert images and all(i.endswith(":" + __version__) for i in images), images
    assert images <= built, images - built
