"""Tandem's gateway: the OpenAI API in front of the decode (and prefill) services.

Module map:
  __main__     `main(argv)`: flags → settings → uvicorn (`tandem gateway`, `python -m gateway`)
  workers      `--workers N`: the parent that runs N gateway processes on one port (SO_REUSEPORT)
  worker_metrics  the parent's one metrics port: every worker's series, `worker`-labelled
  shedding     load shedding: an adaptive bound on requests in flight, 503 + Retry-After past it
  config       GatewaySettings (pydantic-settings; flags and TANDEM_GATEWAY_* variables)
  app          create_app: state, routes, error handlers, access log
  deps         GatewayState and the `GatewayDep` / `PrincipalDep` dependencies
  edge         Edge: keys + metrics + quotas, their middlewares and lifecycle
  allowlist    EdgeMiddleware: path allowlist (deny by default), body size, Bearer auth
  auth         API keys (env / key file) → Principal (tenant, trust group, limits); sha256 only
  quota        quota contract (sliding-window log, slots) + the in-memory backend
  quota_redis  the same semantics in Redis, one Lua script per step
  quota_service  reserve / release per request; Redis ↔ memory failover (degraded)
  redis_scripts  Lua scripts over one lean pipelined Redis connection (quotas, block index)
  accounting   per request: reserve, settle with actual usage, vLLM metrics, on every exit
  metrics      Prometheus registry (vLLM names + tandem:*) on an internal port
  openapi      the OpenAPI schema with every route's real responses (on the metrics port)
  model_info   tokenizer (engine.light_tokenizer: no torch), max_model_len, generation_config
  protocol     OpenAI request bodies (+ vLLM extra fields)
  preprocess   tokenize, validate (vLLM messages), SamplingParams, one ChildJob per sample
  registry     InstanceRegistry (discovery) + StaticRegistry from settings
  router       Router contract + RoundRobinRouter with per-instance health
  clients      grpc.aio channels to decodes, probes, background aborts
  mux          one GenerateMux stream per decode: requests' starts and cancels, replies demuxed
  dispatch     admission with fallback, ChildStream (detokenize + stop strings), merge
  serving      SSE framing, collecting choices, usage, client disconnects
  logprobs     chat / completions logprobs shapes
  errors       OpenAI-shaped errors and the FastAPI handlers
  access_log   one log line per request (method, allowlisted path, status, latency, tenant)
  routes/      chat, completions, models (+ version), health
"""

__version__ = "0.1.0"
