"""Print the requirements of pyproject.toml's extras (or of the build system)
one per line, for ``pip install -r``: CI installs its tools from the
project's own files without reinstalling attncore.

    python .ci/requirements.py lint          # [project.optional-dependencies] lint
    python .ci/requirements.py build test    # several extras
"""
import os
import sys

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
for name in sys.argv[1:]:
    if name not in extras:
        sys.exit(f"pyproject.toml has no extra {name!r} (extras: {', '.join(sorted(extras))})")
    print("\n".join(extras[name]))
