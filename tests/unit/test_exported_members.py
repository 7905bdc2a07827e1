import subprocess
import sys

import dedupworker


def test_all_is_sorted_and_complete() -> None:
    public = {name for name in vars(dedupworker) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(dedupworker, name)).__name__ == "module"}
    assert dedupworker.__all__ == sorted(dedupworker.__all__)
    assert set(dedupworker.__all__) - {"__version__"} == public - modules


def test_the_core_never_imports_optional_transports() -> None:
    code = (
        "import sys, dedupworker, dedupworker.ops.cli.main, dedupworker.process.worker;"
        "import dedupworker.transports.postgres;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'confluent_kafka')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
