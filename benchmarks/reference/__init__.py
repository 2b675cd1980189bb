"""Hand-written agent loops: what a Python user writes without a framework.

`httpx_loop` is the reference over the same HTTP client Treadle exposes; `aiohttp_loop` with
orjson is the floor, the fastest Python stack we know. Both speak to the same fake server and run
the same workloads as `benchmarks.contestants.treadle_loop`.
"""
