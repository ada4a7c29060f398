"""forgelab's HTTP doors onto a run's engines: one loopback server module (`forgelab.serve.http`), several APIs
(the OpenAI-compatible agent door, Tinker's primitives) mounted on it as routers."""
