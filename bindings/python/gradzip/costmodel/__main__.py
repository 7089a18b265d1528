"""``python -m gradzip.costmodel``: the projection tables of gradzip.costmodel_cli."""
import sys

from gradzip.costmodel_cli import main

sys.exit(main())
