"""run.json and host.json: the configuration dataclasses, their JSON reading and checks."""
