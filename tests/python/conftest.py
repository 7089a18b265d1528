"""Settings every test process shares (pytest loads this before the test modules).

torch.compile's on-disk caches (Inductor's FX graph and AOTAutograd caches, under /tmp by
default) are keyed by the traced graph, not by the gradzip extension that traced it: a graph
compiled against an earlier build, whose encoded sizes differ, would be served again and fail.
Each test session compiles into a directory of its own; spawned ranks inherit it.
"""

import os
import tempfile

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="gradzip-inductor-"))
