"""The client side of dualread: it speaks HTTP only, so it works against any deployment.

`clients.http`, `clients.schemas`, `clients.grounding` and `clients.maths` import nothing
beyond httpx, pydantic and numpy (the `client` extra); keep it that way (a test blocks the
model stack and imports them).
"""
