"""trellis-sandbox: run untrusted code through the Sandbox Fusion HTTP API (client, reward, tool, server)."""
