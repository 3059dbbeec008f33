def test_mesh_package_follows_the_rules(check_package):
    check_package("mesh")
