"""`python -m app.engine ...`: the engine process."""

from app.engine.core import main

main()
