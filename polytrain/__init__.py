"""The deployment tools: the `polytrain` command (:mod:`polytrain.cli`), its REST client
(:mod:`polytrain.client`), a whole deployment on one host's loopback (:mod:`polytrain.stack`,
used by `polytrain up`, `polytrain demo` and the end-to-end tests) and the demo
(:mod:`polytrain.demo`).

It starts both deployables, so it may import `backend`, `worker` and `contracts`; neither
deployable imports it, and rank processes do not see it (docs/architecture.md, Layout).
"""
