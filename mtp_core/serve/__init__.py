"""The OpenAI-compatible HTTP server (`mtp serve`): FastAPI + uvicorn in the API process, the engine in its own
process (docs/serving.md)."""
