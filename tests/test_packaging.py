"""How the package installs: nothing generic is importable at the top level, so a user's own
``models.py`` or ``server.py`` beside their script cannot shadow jaxpaged's modules."""

import subprocess
import sys
import textwrap

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
    run = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    # The script's own modules are the ones its bare imports found; jaxpaged's are its own.
    assert run.stdout.split() == ["models", "server", "pallas_kernels", "jaxpaged.llm", "jaxpaged.server.app"]
