"""Planning a call: requests, input checks, plans and their cache, rank agreement. (docs/design.md, "Code map")."""
