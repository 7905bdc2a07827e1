"""The operator console: `dedupworker console`, server-rendered pages over the workers' database.

Installed with `pip install 'dedupworker[console]'` (Flask, waitress) and imported by that
command only; the package itself imports neither, so `dedupworker --help` works without them.

    cli.py      the `console` subcommand
    app.py      create_app(dsn, token) and serve(app, host, port)
    pages.py    the pages that read; actions.py the forms that act (admin functions)
    auth.py     the token, sessions and CSRF; render.py what every page shares
"""
