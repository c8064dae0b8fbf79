"""``outboxd ui``: a small server-rendered web console (Starlette + Jinja2, the ``[ui]`` extra)."""
