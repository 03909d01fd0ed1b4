"""Where the tests find the checkout: its root (pyproject.toml, docs/, deploy/, docker-compose.yml) and
the folder of these kits (a subprocess that imports them puts it on its path)."""

from pathlib import Path

KIT = Path(__file__).resolve().parent
ROOT = KIT.parents[1]
