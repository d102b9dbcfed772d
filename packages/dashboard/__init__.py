"""`dtrain dashboard`: a local web app and REST API over the control layer (dtrain.control).

    app.py      create_app(): the FastAPI app, its error mapping and the access guard
    api.py      JSON under /api/v1 (its OpenAPI page at /docs)
    pages.py    server-rendered pages (Jinja2 templates in templates/; charts drawn by static/charts.js)
    live.py     a run's new metrics, events, log lines and status as server-sent events
    table.py    filtering and sorting the runs table (pages and API share it)
    auth.py     the access token for a non-local bind, and the checks every request passes
    server.py   serve(): bind, then run uvicorn until the caller's Handle says stop

Every read goes through dtrain.control (runs, nodes, nodestate); nothing here touches a run's files
or a node directly. fastapi, uvicorn and jinja2 are the `dashboard` extra: imported only by
`dtrain dashboard`, never by the rest of the CLI.
"""
