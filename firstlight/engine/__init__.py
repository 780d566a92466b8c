"""The serving engine: scheduler, KV-cache blocks, runner, sampler, server."""
