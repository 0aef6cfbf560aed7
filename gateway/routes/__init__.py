"""HTTP routes, one file per concern; `app.create_app` includes their routers."""
