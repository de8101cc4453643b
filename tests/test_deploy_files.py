"""The deployment files docs/deploy.md tells a platform engineer to use are valid: the systemd
units (`systemd-analyze verify`, where available, with the paths of this checkout's venv), and
HAProxy's configuration (`haproxy -c`, filled in as deploy/stack.py fills it in). The stack
itself runs them: tests/test_multinode.py."""

from __future__ import annotations

import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.stack_independent

ROOT = Path(__file__).resolve().parent.parent
UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))


def test_every_process_has_a_unit_and_the_guide_names_each() -> None:
    names = {unit.name for unit in UNITS}
    assert names == {"governance-web.service", "governance-beat.service",
                     "governance-worker-killswitch.service",
                     "governance-worker-webhooks.service", "governance-worker-bulk.service"}
    guide = (ROOT / "docs" / "deploy.md").read_text()
    for name in names:
        assert name in guide


def test_the_systemd_units_verify(tmp_path: Path) -> None:
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    bin_dir = Path(sys.executable).parent
    for unit in UNITS:
        text = unit.read_text().replace("/opt/governance/.venv/bin/", f"{bin_dir}/")
        text = text.replace("WorkingDirectory=/opt/governance", f"WorkingDirectory={ROOT}")
        (tmp_path / unit.name).write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", *sorted(map(str, tmp_path.iterdir()))],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_the_proxy_configuration_is_valid(tmp_path: Path) -> None:
    if not shutil.which("haproxy"):
        pytest.skip("haproxy is not installed (apt-get install haproxy)")
    cert = tmp_path / "proxy.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", str(tmp_path / "k"),
                    "-out", str(tmp_path / "c")], check=True, capture_output=True)
    cert.write_bytes((tmp_path / "c").read_bytes() + (tmp_path / "k").read_bytes())
    config = tmp_path / "haproxy.cfg"
    config.write_text(string.Template((ROOT / "deploy" / "haproxy.cfg").read_text()).substitute(
        bind="127.0.0.1", http_port=8080, https_port=8443, cert=cert,
        servers="    server web1 10.0.0.1:8000\n    server web2 10.0.0.2:8000"))
    result = subprocess.run(["haproxy", "-c", "-f", str(config)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
