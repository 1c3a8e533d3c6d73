"""`llamax serve`: an OpenAI-compatible HTTP server over llamax.Engine, with llama-server's own endpoints.

Needs the server extra: `pip install "llamax[server]"` (Starlette, uvicorn, pydantic, prometheus_client).
`create_app(engine)` gives the ASGI app, to mount in an application of one's own; `serve(engine)`
runs it under uvicorn as `llamax serve` does.
"""
from llamax.server.app import create_app
from llamax.server.run import serve

__all__ = ["create_app", "serve"]
