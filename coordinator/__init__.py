"""The somatize coordinator: worker registry, jobs, strategies over ``TransportContext``."""
