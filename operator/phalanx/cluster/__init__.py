"""The only code that talks to the API server: client, caches of watched state, plan execution."""
