"""The chat app: `chainlit run app/main.py` from the project root.

Chainlit imports this file by its path: it makes the project importable, registers the chat's handlers
(app/web/chat.py) and starts the web process (`chat.start()`: settings, backend, guard, sign-in, the API on
the same server).
"""

import gc
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `chainlit run app/main.py` imports this file by path
    sys.path.insert(0, str(ROOT))

from app.web import chat  # noqa: E402  (registers the Chainlit handlers)

chat.start()

# What is loaded by now (Chainlit, this app) lives as long as the process: frozen, no garbage collection
# walks it again. A full collection of the API's imports alone took 15-22 ms on an idle core, and /health
# and every stream wait for one (docs/benchmarks.md, "Serving many streams at once").
gc.freeze()
