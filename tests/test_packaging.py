"""How the package installs: nothing generic is importable at the top level, so a user's own
``models.py`` or ``server.py`` beside their script cannot shadow jaxpaged's modules."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import jaxpaged.kernels, jaxpaged.models, jaxpaged.server
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.server import build_app
    import models, server, pallas_kernels
    print(models.MINE, server.MINE, pallas_kernels.MINE, LLM.__module__, build_app.__module__)
""")


def test_a_script_beside_its_own_models_and_server_modules_imports_jaxpaged(tmp_path):
    for name in ("models", "server", "pallas_kernels"):
        (tmp_path / f"{name}.py").write_text(f"MINE = {name!r}\n")
    (tmp_path / "script.py").write_text(SCRIPT)
    run = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    # The script's own modules are the ones its bare imports found; jaxpaged's are its own.
    assert run.stdout.split() == ["models", "server", "pallas_kernels", "jaxpaged.llm", "jaxpaged.server.app"]


def _readme_commands() -> list[str]:
    """The one-line commands of README's set-up section, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme[
        readme.index("## Set-up on a fresh machine") : readme.index("\n## ", readme.index("## Set-up"))
    ]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [b.strip() for b in blocks if "pip install" in b]


def test_ci_runs_the_readme_set_up_commands_verbatim():
    serve, test = _readme_commands()
    assert "[test]" not in serve and serve.endswith("jaxpaged serve")
    ci = (ROOT / ".ci" / "run").read_text()
    # The serve command runs in a venv of its own (so the test extra cannot help it), the test command as is.
    assert f"smoke_in_venv python '{serve}'" in ci
    assert ci.rstrip().endswith(test)
