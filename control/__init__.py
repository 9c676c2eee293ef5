"""Control plane between appliance and trainer, and the trainer-side integration."""
