def test_pipeline_package_follows_the_rules(check_package):
    check_package("pipeline")
