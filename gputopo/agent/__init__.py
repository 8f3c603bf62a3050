"""gputopo node agent: discovers GPUs, NVLink, NICs, health and GPUs in use, and publishes them."""
