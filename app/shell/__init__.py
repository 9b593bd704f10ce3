"""The server around the doors: settings and the model's choice, the aiohttp application and its routes, the
processes (engine and workers), the shared context, auth, metrics, the event loop's lag, the balancer's probes, and
requests routed to the worker that holds a call."""
