"""Run every command quoted in docs/tutorials/*.md and write its real output under it.

A tutorial page quotes a command in a block that starts with a marker line and holds the
command alone; the rendered output goes into the `text` block right after it:

    <!-- run -->
    ```bash
    minispeed run --nproc_per_node 2 examples/tutorials/train.py --deepspeed_config ...
    ```
    ```text
    (replaced by the command's output)
    ```

    python scripts/render_tutorials.py [docs/tutorials/zero.md ...]

Pages are rewritten atomically (temporary file, fsync, rename). The launcher's own log lines
(torchrun's warnings) are dropped; everything the script prints is kept. tests/engine/
test_tutorials.py runs the same commands (with fewer steps) and checks what the pages claim.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"<!-- run -->\n```bash\n(?P<cmd>.*?)\n```\n```text\n(?P<out>.*?)```\n", re.S)
_NOISE = re.compile(r"^(W\d{4}|E\d{4}|I\d{4}|\*{5}|Setting OMP_NUM_THREADS|\[W\d+)")


def commands(page: Path) -> list[str]:
    """The commands quoted for running in `page`, in order."""
    return [m["cmd"].replace("\\\n", " ") for m in BLOCK.finditer(page.read_text())]


def run(cmd: str, timeout_s: int = 600) -> str:
    """Run `cmd` from the repository root with the venv first on PATH; its output, launcher noise
    dropped. A failing command raises, naming it."""
    env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", COLUMNS="140")
    proc = subprocess.run(
        cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    out = "\n".join(
        line for line in (proc.stdout + proc.stderr).splitlines() if not _NOISE.match(line)
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd!r} exited {proc.returncode}:\n{out[-3000:]}")
    return out.strip() + "\n"


def render(page: Path) -> None:
    text = page.read_text()

    def fill(m: re.Match) -> str:
        cmd = m["cmd"]
        print(f"[{page.name}] {cmd.replace(chr(92) + chr(10), ' ')}", flush=True)
        out = run(cmd.replace("\\\n", " "))
        return f"<!-- run -->\n```bash\n{cmd}\n```\n```text\n{out}```\n"

    new = BLOCK.sub(fill, text)
    fd, tmp = tempfile.mkstemp(dir=page.parent, prefix=f".{page.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(new)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, page)


def main(argv: list[str]) -> None:
    pages = [Path(a) for a in argv] or sorted((ROOT / "docs" / "tutorials").glob("*.md"))
    for page in pages:
        render(page)


if __name__ == "__main__":
    main(sys.argv[1:])
