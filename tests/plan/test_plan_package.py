def test_plan_package_follows_the_rules(check_package):
    check_package("plan")
