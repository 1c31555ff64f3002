"""Layer 8: the web console, `edge-agent console --db LEADER_DB`, a process of its own beside the leader.

It reads the leader's database (the same views as `edge-agent status`, `rejects` and `rollout
status`) and writes rollout controls through the same control rows as the CLI; the leader
applies them on its next tick. Server-rendered HTML (Jinja2, autoescaped: device ids, tags and
reasons come from devices, one of which may be hostile), no JavaScript, nothing loaded from the
internet; pages refresh themselves every few seconds.

    data.py       what each page shows, read from the database
    templates/    the pages (Jinja2)
    server.py     HTTP, the token, the controls
"""
