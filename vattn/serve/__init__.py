"""An OpenAI-compatible HTTP server over the engine (`vattn serve`; the
`vattn[serve]` extra): `protocol` reads requests, `loop` runs the engine on
its own thread, `responses` writes OpenAI's bodies and stream chunks,
`metrics` keeps the Prometheus figures, `app` is the FastAPI front, and
`server` puts them on uvicorn."""
