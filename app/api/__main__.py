"""`python -m app.api`: the API alone."""

from app.api.routes import main

main()
