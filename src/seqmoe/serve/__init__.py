"""`seqmoe serve`: an OpenAI-compatible HTTP server for an offloaded MoE model.

    HTTP handlers (api) ──► queue of jobs (--admission) ──► Batcher thread (batcher) ──► offloaded model (seqmoe.runtime)
          ▲                                        │
          └──── text deltas, finish, usage ◄───────┘

`startup` loads and offloads the model and starts its `Batcher`; `api.create_app` is the FastAPI app;
`sampling` holds the pure parts (token choice, stop sequences). Needs the `serve` extra
(fastapi, uvicorn) besides torch and transformers.
"""
